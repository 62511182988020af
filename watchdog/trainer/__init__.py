"""The instrumented trainer: a small transformer LM with activation checkpointing."""
