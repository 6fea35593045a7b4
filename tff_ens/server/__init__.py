"""The server step's TensorFlow, run in the driver between TFF computations (on a GPU when
there is one): the student's distillation, its targets and the server's data.
"""
