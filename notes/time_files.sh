#!/bin/bash
# usage: [SRC=tree] time_files.sh OUTFILE files...
# per file: wall s and CPU s (user+sys of pytest and the processes it reaped), load average before/after
out=$(realpath $1); shift
src=${SRC:-$PWD}
logs=$(dirname $out)/logs/$(basename $out .tsv); mkdir -p $logs
for f in "$@"; do
  log=$logs/$(echo $f | tr / _).log
  l=$(cut -d' ' -f1 /proc/loadavg)
  (cd $src && PYTHONPATH=$src:/work/wt-suite/notes /usr/bin/time -f "TIME wall=%e user=%U sys=%S" timeout 3000 python -m pytest -q -p no:cacheprovider --durations=15 -p reap_plugin $f > $log 2>&1)
  rc=$?
  l2=$(cut -d' ' -f1 /proc/loadavg)
  printf "%s\t%s\trc=%s\tload %s->%s\t%s\n" "$f" "$(grep TIME $log | tail -1)" "$rc" "$l" "$l2" "$(grep -E 'passed|failed' $log | tail -1)" >> $out
done
