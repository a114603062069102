"""The ``spyre`` device backend of TorchInductor: interface, lowerings, scheduling, wrapper."""
