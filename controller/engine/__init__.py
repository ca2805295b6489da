"""Pure decisions. Input: a snapshot of the world and the time. Output: intended writes. No I/O.

Entry point: :func:`controller.engine.maintainer.decide`.
"""
