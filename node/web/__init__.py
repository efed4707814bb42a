"""The web console and HTTP API (``[web]``, off by default; ``docs/web.md``).

:mod:`segnode.node.web.facts` builds the JSON facts that ``segnode jobs --json``, ``segnode status``
and the API share; it needs nothing beyond the node's own dependencies. The server
(:mod:`segnode.node.web.server`, :mod:`segnode.node.web.app`) needs the ``web`` extra (Starlette,
uvicorn) and is imported only when ``[web]`` is enabled. :mod:`segnode.node.web.preview` renders the
preview PNG of each result.
"""
