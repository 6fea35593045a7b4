"""TFF stages (distributor, client work, aggregator, finalizer) and their composition into
processes, shared by the algorithms.
"""
