# Sourced by scripts/gpu_check.sh and gpu_train.sh: the device image has no Hydra, so its three
# pure-Python wheels (0.4 MB) travel in .whl/ when built here first (antlr4's release is a source
# archive, hence `pip wheel`), and are installed outside the tree for this call:
#   echo /.whl/ >> .git/info/exclude; python3 -m pip wheel -q --no-deps -w .whl hydra-core==1.3.8 \
#     omegaconf==2.3.1 antlr4-python3-runtime==4.9.3      (then carry [".whl", ...])
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
