"""Adapters that let inference engines use kvpool as their KV store.

* :mod:`kvpool.integrations.vllm`: ``KvpoolConnector``, a vLLM v1 KV connector
  (``pip install 'kvpool[vllm]'``).
"""
