"""Speed and memory benchmarks and the GPU acceptance run. Each script runs as `python bench/<name>.py`
(the package is installed with the project, so its modules import one another as `bench.<name>`) and
writes its figures with the provenance helpers of `bench.results`."""
