"""The rank's process in its job: distributed state and the one module that issues collectives, what each rank
reports of itself, the console log and progress, the stall watchdog, memory probes, the profiler, which libraries
were imported. May import data/ and rehearsal.py; nothing else in train/."""
