"""Session 15's launch model for two or more chains of ordered dQ adds (CPU; output in chain_model.log).

Greedy list scheduling on 132 SMs, as in benchmarks/ordered_launch_model.py (cost of a tile: the query blocks it
visits + 2), plus the chains' waits: tile t reaches block b one step per block and adds only after the chain's
previous visitor of b has added, plus `lat` steps. T key tiles per pair, causal (tile t visits blocks t..T-1);
8k: T=64, 64 pairs in groups of 4; 16k: T=128, 32 pairs in groups of 2 (the kernel's groups). Prints the
efficiency (ideal / modelled makespan) of one chain (the kernel's order), k chains launched lowest chain first,
and the free order; then k chains with a later chain deferred by `defer` groups, for lat 0.1 / 0.5 / 0.9.
Run: python3 chain_model.py
"""
import heapq, itertools
SMS=132; FIXED=2.0
def sim(T, pairs, group, order_fn, chains_of, lat=0.3):
    # order_fn(T) -> list of tiles in launch order for one pair; chains_of(t)-> chain id
    # a tile t visits blocks t..T-1 ascending, one unit per step; adds to block b must follow the previous
    # visitor in its chain (next higher tile in same chain visiting b) add time + lat
    launch=[]
    for g0 in range(0,pairs,group):
        ps=range(g0,min(pairs,g0+group))
        for t in order_fn(T):
            for p in ps: launch.append((p,t))
    free=[0.0]*SMS; heapq.heapify(free)
    add={}  # (p, chain, b) -> (tile, time) of last add
    done={}
    # process in launch order; a CTA's chain predecessor launched earlier => its add times known
    for p,t in launch:
        start=heapq.heappop(free)
        c=chains_of(t,T)
        time=start+FIXED/2
        for b in range(t,T):
            time+=1.0
            prev=add.get((p,c,b))
            if prev is not None: time=max(time, prev+lat)
            add[(p,c,b)]=time
        time+=FIXED/2
        heapq.heappush(free,time)
    ideal=pairs*sum(T-t+FIXED for t in range(T))/SMS
    return ideal/max(free)
desc=lambda T: list(reversed(range(T)))
one=lambda t,T:0
def split(k):
    def order(T):
        s=[T*i//k for i in range(k+1)]
        return [t for i in range(k) for t in reversed(range(s[i],s[i+1]))]
    def ch(t,T):
        return min(k-1, t*k//T)
    return order,ch
for T,pairs,group in ((64,64,4),(128,32,2)):
    print(T, "desc 1 chain", round(sim(T,pairs,group,desc,one),3))
    for k in (2,3,4):
        o,c=split(k); print(T, f"{k} chains longest chain first", round(sim(T,pairs,group,o,c),3))
    # free order without chain (ascending, no waits)
    print(T,"free asc nochain", round(sim(T,pairs,group,lambda T: list(range(T)), lambda t,T: t),3))
print("--- variants")
def sim2(T,pairs,group,k,defer,lat=0.3):
    s=[T*i//k for i in range(k+1)]
    chunks=[list(reversed(range(s[i],s[i+1]))) for i in range(k)]  # longest chain first
    groups=[list(range(g0,min(pairs,g0+group))) for g0 in range(0,pairs,group)]
    # phase j of group g launched at slot g + j*defer
    items=[]
    for gi,ps in enumerate(groups):
        for j,ch in enumerate(chunks):
            items.append((gi+j*defer, gi, j, ps, ch))
    items.sort(key=lambda x:(x[0],x[2]))
    launch=[(p,t) for _,_,_,ps,ch in items for t in ch for p in ps]
    free=[0.0]*SMS; add={}
    for p,t in launch:
        start=heapq.heappop(free); c=min(k-1,t*k//T); time=start+FIXED/2
        for b in range(t,T):
            time+=1.0; prev=add.get((p,c,b))
            if prev is not None: time=max(time,prev+lat)
            add[(p,c,b)]=time
        heapq.heappush(free,time+FIXED/2)
    ideal=pairs*sum(T-t+FIXED for t in range(T))/SMS
    return ideal/max(free)
for T,pairs,group in ((64,64,4),(128,32,2)):
    for k in (1,2,3):
        for defer in (0,1,2):
            print(T,k,defer,[round(sim2(T,pairs,group,k,defer,lat),3) for lat in (0.1,0.5,0.9)])
