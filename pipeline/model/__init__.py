"""The model: its folder and contract, the preprocessing spec, the reference decoding, and the default model."""
