"""Planning: the GPU catalog, memory estimates and strategy choice (`shoal plan`), and
the environment checks of `shoal doctor`."""
