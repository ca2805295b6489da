"""The e2e suite's safety catch: it deletes pods and resources, so it runs only against a kind cluster.

Allowed: the current kube context's name starts with ``kind-`` (what ``kind create cluster`` writes), or it
equals ``$CFM_E2E_CONTEXT`` (an explicit opt-in for another throwaway cluster). Anything else is refused
before a single request is sent. Every later kubectl call names the checked context explicitly, so a
context switch during the run cannot redirect it.
"""

from __future__ import annotations

import os
import subprocess


class ContextRefused(RuntimeError):
    pass


def check_context(context: str, allowed: str | None = None) -> str:
    """``context`` if the e2e suite may use it, else ContextRefused with the reason and the way out."""
    allowed = os.environ.get("CFM_E2E_CONTEXT") if allowed is None else allowed
    if context.startswith("kind-") or (allowed and context == allowed):
        return context
    raise ContextRefused(
        f"refusing to run the e2e suite against kube context {context!r}: it deletes pods and resources. "
        f"Use a kind cluster (`make kind-up`, context 'kind-<name>'), or set CFM_E2E_CONTEXT={context} "
        f"if this context really is a throwaway test cluster."
    )


def current_context(kubeconfig: str | None = None) -> str:
    cmd = ["kubectl", "config", "current-context"]
    if kubeconfig:
        cmd += ["--kubeconfig", kubeconfig]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise ContextRefused(f"no current kube context ({out.stderr.strip() or 'kubectl failed'})")
    return out.stdout.strip()
