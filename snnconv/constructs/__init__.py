"""Graph rewrites that give common constructs their integrate-and-fire form, one pass each.

A pass matches its pattern on the traced graph, rewrites the caller's copy in place and returns
a report; :mod:`snnconv.stages.prepare` runs them. The constructs that no integrate-and-fire network
computes are refused by name (:mod:`snnconv.refusals`).
"""
