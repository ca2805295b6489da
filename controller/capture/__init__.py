"""The capture agent (:mod:`.agent`) and its pluggable dispatcher runtime (:mod:`.runtime`), with test hooks."""
