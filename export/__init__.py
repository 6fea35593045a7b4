"""TFLite export and on-device evaluation of trained tff-ens runs."""
