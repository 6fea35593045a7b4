"""The program around the processes: the run's settings, the round loop, the simulated
federation, evaluation, reporting and the run's files.
"""
