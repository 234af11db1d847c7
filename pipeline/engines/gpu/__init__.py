"""The gpu engine: decode, resize and classify on one GPU with torch.

``jpeg`` triages on the CPU, ``decoders`` decode on the GPU, ``resample`` holds Pillow's resampling maths,
``classifier`` (``GpuClassifier``) runs the pipelined batches, ``dali`` the DALI decode/resize path, ``engine`` (``GpuEngine``) adapts it to the engine
contract, ``networks`` builds the torch networks and ``triton_model`` serves ``GpuClassifier`` as the gpu profile
of a Triton repository. torch is imported only when a classifier is built.
"""
