"""tff-ens: ensemble federated learning on TensorFlow Federated."""
