"""What a benchmark run measured, and the tables and plots made from it.

:mod:`.results` reads the workers' result files; :mod:`.summary` compares
the methods of one run; :mod:`.plot` draws its PNGs; :mod:`.tables` and
:mod:`.script_tables` print the benchmarks page's tables from the committed
results.
"""
