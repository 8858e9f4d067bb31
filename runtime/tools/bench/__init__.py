"""The benchmarks: ``sfa-rd2h bench`` (the micro benchmarks in ``micro``, the runtime's
system rows in ``system`` with their second processes in ``peers``, driven and reported by
``suite``, charted by ``plot``) and ``sfa-rd2h vllm-bench`` (``serving``: real vLLM engines
under load). What they share - result rows, timing, interleaving, goals - is ``common``;
the arrows point from the benchmarks to ``common`` and from ``suite`` to the benchmarks."""
