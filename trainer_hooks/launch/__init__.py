"""Starting a job: ``resihp launch`` (launcher), Open MPI hostfiles (hostfile: pure) and the
MPI bootstrap into torch.distributed (bootstrap).
"""
