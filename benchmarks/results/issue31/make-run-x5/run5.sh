#!/bin/bash
# Five fresh-clone `make run`s in a row, each timed; the job's own wall time is logged apart from installs.
for i in 1 2 3 4 5; do
  rm -rf /work/mr; git clone -q /work/main /work/mr; cd /work/mr
  s=$(date +%s)
  make venv > /work/mrlogs/install_$i.log 2>&1
  m=$(date +%s)
  make run > /work/mrlogs/run_$i.log 2>&1; rc=$?
  e=$(date +%s)
  echo "run $i rc=$rc install_s=$((m-s)) run_s=$((e-m)) load=$(cut -d' ' -f1-3 /proc/loadavg)" >> /work/mrlogs/summary.txt
  cp out/mainjob.json /work/mrlogs/mainjob_$i.json 2>/dev/null
  cd /work
done
