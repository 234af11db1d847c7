"""INT8 models: the static quantization, which nodes stay in float, and the gate against FP32."""
