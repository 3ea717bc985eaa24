"""megafp8.parallel: process groups, tensor/sequence-parallel layers, pipeline schedules, data parallel.

Installed as `megafp8.parallel`; never import it as a bare `parallel`.
"""
