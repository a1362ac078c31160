"""A small Flax NNX model zoo whose attention is one config field: "flash", "dense" or a callable."""
