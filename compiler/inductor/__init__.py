"""The ``spyre`` device backend of TorchInductor: interface, lowerings, scheduling, wrapper."""

# The graph's meta key under which the backend hands the wrapper the indices of the inputs
# whose memory does not change between calls (parameters, static caches).
STATIC_INPUTS = "spyre_rt_static_inputs"
