"""HOW a step is computed. The only package that imports torch, and only in its torch modules:
``model_runner.base``, ``model_runner.fake``, ``model_runner.sim`` and ``model_runner.step``
stay torch-free."""
