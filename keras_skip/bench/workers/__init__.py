"""The benchmark's worker processes and what they train.

:mod:`.launcher` starts local workers with their ``TF_CONFIG``;
:mod:`.worker` is one worker of a ``keras-skip bench`` run; :mod:`.devices`
splits one process's CPU into replicas; :mod:`.workloads` holds the data and
models; :mod:`.baselines` the other ways of choosing the interval.
"""
