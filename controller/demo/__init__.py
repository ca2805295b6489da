"""The whole system in one command: an API (embedded, or a cluster), the maintainer, captures, examples."""
