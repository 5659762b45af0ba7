"""Compile and memory machinery: ahead-of-time and persistent compilation caches, the program budget, the
device-memory plan and the adapter paging store."""
