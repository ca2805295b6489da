"""The kubectl plugin ``kubectl-changefeed``: see ``controller.cli.__main__`` and docs/kubectl-plugin.md."""
