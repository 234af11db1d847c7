"""The gpu engine: DALI decode + resize and a torch network on one GPU.

``jpeg`` triages on the CPU, ``dali`` (``DaliPrep``, with ``dali_runner``) decodes and resizes with DALI,
``classifier`` (``GpuClassifier``) runs the pipelined batches through the network, ``engine`` (``GpuEngine``) adapts
it to the engine contract, ``stream`` feeds requests into one pipeline and ``networks`` builds the torch networks;
``pipeline.triton.serve.gpu_model`` serves ``GpuClassifier`` as the gpu profile of a Triton repository. torch and
DALI are imported only when a classifier is built.
"""
