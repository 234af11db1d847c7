"""Engines: one module per engine (``onnx``, ``openvino``, ``triton``, ``gpu``), each exporting its ``SPEC``, listed in
``registry``.

``base`` holds the contract every engine keeps (``Engine``, ``Result``, ``results_from_topk``, ``EngineSpec``);
``registry`` the engines by name, which the config, the CLI, the actor and the job read. ``triton`` and ``gpu`` are
thin adapters over ``pipeline.triton`` (the client) and ``pipeline.gpu`` (the classifier), which never import an
engine.
"""
