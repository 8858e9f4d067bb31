"""The RD2H protocol as data and pure functions: wire codec, topology, layout, rule catalog."""
