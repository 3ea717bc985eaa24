# sourced at the start of each device call
python3 -m pip install -q --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export WORKDIR=/tmp/w SAVE= LOG_INTERVAL=5
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import torch; print(torch.__version__)"
