"""The Inductor-based compiler of spyre_rt (imported as ``spyre_rt.compiler``)."""
