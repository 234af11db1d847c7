"""Engines: one module per engine (``onnx``, ``openvino``, ``triton``, ``gpu``), each exporting its ``SPEC``, listed in
``registry``.

``base`` holds the contract every engine keeps (``Engine``, ``Result``, ``results_from_topk``, ``EngineSpec``);
``registry`` the engines by name, which the config, the CLI, the actor and the job read. Engines import from
``pipeline.triton``, never the other way round.
"""
