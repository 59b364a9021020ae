"""The attention kinds of the FPA family as resolved objects: what each one needs, read as flags.

Every path (naive, chunked, Triton, the ring, the cache, the layer) asks the spec what it needs instead of
comparing the kind's name; `resolve_kind` is the one place a name is validated. A new variant adds one
entry here and reads its flags where they matter.

    fpa:     b_ij = min_{j <= t <= i} phi_t - phi_j   (has_field, range_min)
    fox:     b_ij = phi_i - phi_j                    (has_field, query_term; its field is always "gate")
    softmax: b_ij = 0
"""

from __future__ import annotations

from dataclasses import dataclass

from fpa_model.config import ATTENTION_KINDS


@dataclass(frozen=True)
class AttentionKind:
    """One attention kind: its name, what its bias needs and its id for the Triton kernels."""

    name: str
    has_field: bool  # the bias reads a field phi (else phi is None)
    range_min: bool  # the bias needs min of phi over [j, i] (and the tiled S / M / P split, the routing)
    kernel_id: int  # the KIND constexpr of the Triton kernels
    fixed_field: str | None = None  # the field parametrization the kind always uses (None: the config's)

    @property
    def query_term(self) -> bool:
        """The bias has a +phi_i term of the query (fox): a field without the range minimum."""
        return self.has_field and not self.range_min

    def __str__(self) -> str:
        return self.name


FPA = AttentionKind("fpa", has_field=True, range_min=True, kernel_id=0)
FOX = AttentionKind("fox", has_field=True, range_min=False, kernel_id=1, fixed_field="gate")
SOFTMAX = AttentionKind("softmax", has_field=False, range_min=False, kernel_id=2)

SPECS: dict[str, AttentionKind] = {s.name: s for s in (FPA, FOX, SOFTMAX)}
assert tuple(SPECS) == ATTENTION_KINDS  # one list of names, the config's


def resolve_kind(kind: str | AttentionKind) -> AttentionKind:
    """The spec of a kind given by name (or the spec itself); a one-line error for an unknown name."""
    if isinstance(kind, AttentionKind):
        return kind
    spec = SPECS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise ValueError(f"unknown attention kind {kind!r}; expected one of {ATTENTION_KINDS}")
    return spec


__all__ = ["FOX", "FPA", "SOFTMAX", "SPECS", "AttentionKind", "resolve_kind"]
