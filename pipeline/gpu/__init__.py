"""GPU classification: DALI decode + resize and a torch network on one GPU, all of it, for the gpu engine
(``pipeline.engines.gpu``) and the gpu profile's served model (``pipeline.triton.serve.gpu_model``) alike.

``defaults`` holds the values and names the GPU paths share (stdlib only), ``jpeg`` triages on the CPU,
``dali_graph`` is the DALI preprocessing graph, ``dali`` (``DaliPrep``, with ``dali_runner``) decodes and resizes
with it, ``classifier`` (``GpuClassifier``) runs the pipelined batches through the network, ``stream`` feeds requests
into one pipeline, ``networks`` builds the torch networks (``onnx_torch`` converts a user's, ``network_cache`` keeps
the checked conversion, ``precision`` gates FP16). Nothing here imports Triton or an engine; torch and DALI are
imported only when a classifier is built.
"""
