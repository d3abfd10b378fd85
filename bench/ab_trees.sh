# Sourced by bench/*_ab.sh at the start of a device call: bench/device_tree.sh (the wheels, this tree,
# the card named), then the base tree (`git archive --format=tar.gz -o .whl/base.tar.gz <base commit>`)
# unpacked in /tmp/base, and `install DIR` to put either tree in place in turn.
source bench/device_tree.sh
here=$PWD
rm -rf /tmp/base && mkdir -p /tmp/base && tar xzf .whl/base.tar.gz -C /tmp/base
