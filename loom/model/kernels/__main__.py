"""`python -m loom.model.kernels`: build every library (ISAS) into torch's extension cache,
loading none, whatever this CPU offers; the image bakes them so."""

from loom.model.kernels import ISAS, build

for chosen in ISAS:
    print(build(chosen))
