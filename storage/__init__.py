"""Object store and (later) the trajectory lake: a library every service may use, and the storage sink."""
