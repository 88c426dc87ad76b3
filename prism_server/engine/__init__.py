"""The engine-thread side: the Engine facade, one thread per device, the model step, loading."""
