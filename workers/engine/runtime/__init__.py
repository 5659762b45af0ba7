"""Compile and device machinery: ahead-of-time and persistent compilation caches, the warm-up, the engine lock,
the device mesh, and multi-host."""
