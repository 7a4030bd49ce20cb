import os
import sys

# Several concurrent OpenBLAS QR/SVD calls inside one XLA program can deadlock the CPU thread
# pool (seen with the randomized-SVD compressor): one BLAS thread per call avoids it.
os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
