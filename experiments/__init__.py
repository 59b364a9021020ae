"""Experiments beside the pipeline: studies that use the model and the pipeline's helpers but are not part
of a training run (`fpa synthetic`: the one-layer synthetic tasks). They sit above pipeline, fpa_model and
data_prep and below launch, whose CLI runs them (tests/test_layers.py)."""
