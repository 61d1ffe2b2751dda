"""The Qwen3.5 hybrid model: NNX modules, attention, the gated delta rule, state pools and restore, weights."""
