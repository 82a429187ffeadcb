"""What the benchmark scripts measure with, beyond what gpu_lab offers its users: the loader
benchmark's chain of timed pairs, the hypervisor's steal and its targets (`loader_method`), and the
same-core instrument (`samecore`). Tests import it as `bench.lib` from the repository root."""
