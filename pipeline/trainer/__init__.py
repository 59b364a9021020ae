"""The trainer's parts, one concern per module; pipeline/train.py composes them into the training loop.

engine               the DeepSpeed config and engine (batch sizes, AdamW, ZeRO stage, precision)
batches              the data a step consumes (loader batches; passkey rows in the passkey phase)
step                 one optimizer step: forward, loss, backward, optimizer step (or the step dropped)
loss                 the language-model loss (chunked over the vocabulary when asked)
sequence_parallel    data x sequence-parallel process groups, the loss over a split sequence
schedule             the learning rate as a function of the step (cosine, warmup-stable-decay)
guards               steps that must not update: non-finite loss, loss spikes (skip or stop)
deepspeed_internals  the one adapter over DeepSpeed's private step machinery (guards and step use it)
validation           the validation loss during training
metrics              metrics.jsonl lines and the logged window (throughput, MFU, memory)
preemption           signals -> checkpoint at the next step -> exit 75, Slurm requeue
train_state          what a checkpoint holds (TrainState, RNG, loader cursor) and when to save; the
                     checkpoints on disk (verified save, load, universal conversion) are pipeline.checkpoint
"""
