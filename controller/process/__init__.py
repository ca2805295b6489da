"""Process tuning: what keeps a long-lived asyncio process's event loop responsive, whatever it runs. Nothing here
is about Kubernetes or the model: the garbage collector's full passes (``tenure``), page faults in the loop
(``heap``), and long turns of the loop (``pacing``). The processes wire these in (the maintainer's runner, the
capture's agent)."""
