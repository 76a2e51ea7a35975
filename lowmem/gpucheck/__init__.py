"""`lowmem gpu_check`: every GPU path of the project checked in one command, stage by stage, each stage ending
with a PASS/FAIL/SKIP line and its figures as JSON lines; `lowmem gpu_bundle`: what a GPU machine without
network needs to run it (the project and the dependencies its image lacks, as wheels, and one script).

`stages` holds the checks, `runs` starts the training commands they check, `check` runs the stages in order
and reports, `bundle` builds the offline bundle.
"""
