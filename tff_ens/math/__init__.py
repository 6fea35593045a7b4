"""Paper math and measurements: the papers' formulas and the metrics of predictions, as NumPy
and TensorFlow functions with no TFF computation.
"""
