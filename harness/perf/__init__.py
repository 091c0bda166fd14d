"""Stage 8, perf: the training-step benchmark on the same ranks and engines (``benchmark``, ``perf_run``,
``perf_rows``),
the nightly's performance section (``perf_section``) and profiler trace summaries (``profile_summary``).
"""
