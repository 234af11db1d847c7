"""The code tritonserver runs: the python-backend models of the portable and gpu profiles and what they share.

``portable_model`` (reference decode + ONNX Runtime), ``gpu_model`` (``GpuClassifier`` behind a request stream, the
gpu profile) and ``backend`` (config parameters, tensors, caps and errors of the python backend). Only the shims that
``pipeline.triton.repository`` writes import these modules, inside the server's stub processes; they are part of
``pipeline.triton``'s room, standing on ``pipeline.gpu`` and below the engines.
"""
